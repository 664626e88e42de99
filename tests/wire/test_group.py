"""The weights group's NCCL options and failure path, decided on CPU (no NCCL here): which environment torch's
ProcessGroupNCCL is constructed under, and how a broken group is closed. The constructor and the process group are
stand-ins that record what they were given; the gloo path is proven with real processes in test_transfer.py."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from inflight.wire import group as group_mod
from inflight.wire.group import NCCL_SURVIVE_PEERS, GroupAddress, WeightsGroup, environment


class _RecordingNCCL:
    """Stands in for torch's ProcessGroupNCCL: keeps the environment and the NCCL config its constructor saw."""

    seen: list[dict[str, str | None]] = []
    max_ctas: list[int] = []

    class Options:
        _timeout = None

        def __init__(self):
            self.config = types.SimpleNamespace(max_ctas=-(2**31), min_ctas=-(2**31))  # NCCL_CONFIG_UNDEF_INT

    def __init__(self, store, rank, world_size, opts):
        _RecordingNCCL.seen.append({name: os.environ.get(name) for name in NCCL_SURVIVE_PEERS})
        _RecordingNCCL.max_ctas.append(opts.config.max_ctas)


def test_an_nccl_weights_group_may_occupy_at_most_its_cap_of_ctas(monkeypatch):
    """Issue 40, point 6: a broadcast waiting on a slow learner must not hold the SMs the engine's kernels need."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _RecordingNCCL, raising=False)
    _RecordingNCCL.max_ctas.clear()
    for address in (
        GroupAddress("127.0.0.1", 0, 2, backend="nccl"),
        GroupAddress("h", 0, 2, backend="nccl", max_ctas=8),
    ):
        group_mod._make_process_group(store=None, rank=1, address=address, timeout=None)
    assert _RecordingNCCL.max_ctas == [group_mod.WEIGHTS_MAX_CTAS, 8]


def test_an_nccl_weights_group_is_built_under_error_handling_that_aborts_the_communicator_not_the_process(
    monkeypatch,
):
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _RecordingNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # torch's default: tear the process down
    monkeypatch.delenv("TORCH_NCCL_ENABLE_MONITORING", raising=False)
    _RecordingNCCL.seen.clear()
    address = GroupAddress("127.0.0.1", 0, world_size=2, backend="nccl")
    group_mod._make_process_group(store=None, rank=1, address=address, timeout=None)
    assert _RecordingNCCL.seen == [
        {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    ]
    # the process's own setting is back for every other group (the learner's default group keeps torch's handling)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_ENABLE_MONITORING" not in os.environ


def test_the_environment_is_restored_even_when_the_constructor_raises(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    with pytest.raises(RuntimeError), environment(NCCL_SURVIVE_PEERS):
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
        raise RuntimeError("ncclCommInitRank failed")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


class _HangingPG:
    """An NCCL group whose abort blocks, as ncclCommAbort can behind a dead peer's queued kernel."""

    def __init__(self):
        self.release = threading.Event()
        self.aborted_on: str | None = None
        self.shutdown_called = False

    def abort(self):
        self.aborted_on = threading.current_thread().name
        self.release.wait(5)

    def shutdown(self):
        self.shutdown_called = True


def _nccl_member(pg) -> WeightsGroup:
    member = WeightsGroup.__new__(WeightsGroup)  # no NCCL here: the member around an already-built group
    member.address = GroupAddress("127.0.0.1", 0, world_size=2, backend="nccl")
    member.rank, member._pg, member.broken = 1, pg, False
    return member


def test_closing_an_nccl_group_aborts_it_on_a_thread_of_its_own_and_never_waits_for_it():
    """Issue 40, point 6: a worker closes on the engine's thread (a rejoin); it used to wait up to 10 s there."""
    pg = _HangingPG()
    member = _nccl_member(pg)
    start = time.monotonic()
    member.close()
    took = time.monotonic() - start
    deadline = time.monotonic() + 5
    while pg.aborted_on is None and time.monotonic() < deadline:
        time.sleep(0.01)
    pg.release.set()
    assert took < 0.1, f"close() waited {took:.2f}s on a hanging abort"
    assert pg.aborted_on == "inflight-nccl-abort" and not pg.shutdown_called
    assert member.broken and member._pg is None


def test_a_closed_group_refuses_the_next_broadcast_naming_the_fix():
    pg = _HangingPG()
    pg.release.set()
    member = _nccl_member(pg)
    member.close()
    with pytest.raises(group_mod.WeightsGroupError, match="form a new one"):
        member.broadcast(torch.zeros(4))


@pytest.mark.parametrize(("first", "workers", "world"), [(1, 1, 2), (1, 2, 3), (3, 4, 7)])
def test_a_serves_workers_take_consecutive_ranks_from_its_first(first, workers, world):
    assert [group_mod.member_rank(first, w, workers, world) for w in range(workers)] == list(
        range(first, first + workers)
    )


@pytest.mark.parametrize(
    ("first", "worker", "workers", "world", "match"),
    [
        (0, 0, 1, 2, "rank 0 is the learner's"),
        (1, 2, 2, 3, "outside this serve's 2 workers"),
        (2, 1, 2, 3, "planned fewer ranks than this serve has workers"),
    ],
)
def test_a_worker_rank_outside_the_serves_plan_is_refused_naming_why(first, worker, workers, world, match):
    with pytest.raises(ValueError, match=match):
        group_mod.member_rank(first, worker, workers, world)


SPAWN = multiprocessing.get_context("spawn")


def _tp_worker(port: int, world: int, worker: int, workers: int, out: str) -> None:
    """One engine worker of a tensor-parallel serve: joins at its own rank and writes what the broadcast carried."""
    address = GroupAddress("127.0.0.1", port, world_size=world, group_name="tp-ranks", timeout_s=60.0)
    member = WeightsGroup(address, group_mod.member_rank(1, worker, workers, world))
    bucket = torch.zeros(1024)
    member.broadcast(bucket)
    torch.save({"rank": member.rank, "sum": float(bucket.sum())}, out)
    member.close()


def test_both_workers_of_a_two_worker_serve_join_at_consecutive_ranks_and_receive_every_bucket(tmp_path):
    """Real processes over a real gloo group: the learner (rank 0) and a serve of two workers (ranks 1 and 2, from
    member_rank) — the rank logic a tensor-parallel serve uses, without vLLM."""
    workers, world = 2, 3
    store = group_mod.open_store(GroupAddress("127.0.0.1", 0, world_size=world, timeout_s=60.0), is_host=True)
    outs = [str(tmp_path / f"w{i}.pt") for i in range(workers)]
    children = [SPAWN.Process(target=_tp_worker, args=(store.port, world, i, workers, outs[i])) for i in range(workers)]
    for child in children:
        child.start()
    address = GroupAddress("127.0.0.1", store.port, world_size=world, group_name="tp-ranks", timeout_s=60.0)
    learner = WeightsGroup(address, 0, store)
    learner.broadcast(torch.arange(1024, dtype=torch.float32))
    for child in children:
        child.join(90)
        assert child.exitcode == 0
    learner.close()
    got = [torch.load(out) for out in outs]
    assert [g["rank"] for g in got] == [1, 2]
    assert all(g["sum"] == float(torch.arange(1024).sum()) for g in got)


def test_closing_a_real_group_whose_broadcast_waits_on_a_sleeping_peer_returns_at_once_and_a_new_one_forms():
    """Real gloo groups in one process: the learner (rank 0) sleeps instead of sending; the serve's staging thread
    waits in the broadcast; the engine's thread closes the group (a rejoin) without waiting, and the next group of
    the same members forms and carries a bucket."""
    store = group_mod.open_store(GroupAddress("127.0.0.1", 0, world_size=2, timeout_s=5.0), is_host=True)

    def pair(name: str) -> tuple[WeightsGroup, WeightsGroup]:
        address = GroupAddress("127.0.0.1", store.port, world_size=2, group_name=name, timeout_s=5.0)
        made: dict[int, WeightsGroup] = {}
        joiner = threading.Thread(target=lambda: made.__setitem__(1, WeightsGroup(address, 1)))
        joiner.start()
        made[0] = WeightsGroup(address, 0, store)
        joiner.join(30)
        return made[0], made[1]

    learner, serve = pair("sleeping-peer")
    failed: list[BaseException] = []

    def staging() -> None:
        try:
            serve.broadcast(torch.zeros(256))
        except group_mod.WeightsGroupError as exc:
            failed.append(exc)

    receiving = threading.Thread(target=staging)
    receiving.start()
    time.sleep(0.3)  # the staging thread is inside the broadcast, waiting for rank 0
    start = time.monotonic()
    serve.close()
    took = time.monotonic() - start
    receiving.join(30)
    assert took < 0.1, f"close() on the engine's thread waited {took:.2f}s"
    assert not receiving.is_alive() and len(failed) == 1, "the waiting broadcast must fail, not hang"
    learner.close()

    learner, serve = pair("after-rejoin")
    got = torch.zeros(8)
    receiving = threading.Thread(target=serve.broadcast, args=(got,))
    receiving.start()
    learner.broadcast(torch.arange(8, dtype=torch.float32))
    receiving.join(30)
    assert torch.equal(got, torch.arange(8, dtype=torch.float32))
    learner.close()
    serve.close()
