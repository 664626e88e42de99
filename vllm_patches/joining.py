"""GroupJoin: a worker's membership of the weights group, formed on a thread of its own.

Runs in the serve's worker process, started by `inflight_init_weights_group` (vllm_patches/worker_extension.py) and
read by `inflight_weights_group_state`. Why a thread: vLLM runs every worker RPC on the engine's thread, between two
steps, and forming the group is a rendezvous — it returns only once the learner's rank 0 and every other serve's
workers have joined, up to the learner's `--timeout-s`. Formed on the engine's thread, a group re-formed for a serve
that arrives late (or never) stopped every running serve's decoding for that long. Here the RPC returns at once, the
front end asks for the state between steps (vllm_patches/engine.py:join_weights_group), and no update can begin
before the group formed (`WorkerUpdateState.begin` refuses without a usable group).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from inflight.wire.group import GroupAddress, WeightsGroup
from vllm_patches.cores import on_spare_cores
from vllm_patches.rpc import GroupJoined


class GroupJoin:
    """One attempt at forming the weights group as `rank`; `group` once formed, `error` if it did not."""

    def __init__(
        self,
        address: GroupAddress,
        rank: int,
        device: torch.device,
        formed: Callable[[GroupJoin, WeightsGroup], bool],
    ):
        self.address, self.rank, self.device, self._formed = address, rank, device, formed
        self.group: WeightsGroup | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="inflight-join", daemon=True)

    def start(self) -> GroupJoin:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":  # the current device is per thread; NCCL's communicator binds to it
                torch.cuda.set_device(self.device)
            with on_spare_cores():  # the group's transport thread receives every update: not on the decode's core
                group = WeightsGroup(self.address, self.rank)
        except Exception as exc:  # said to the front end, which fails the join naming it
            self.error = f"{type(exc).__name__}: {exc}"
            return
        if self._formed(self, group):
            self.group = group
        else:
            self.error = "superseded by a newer join before it formed"

    def state(self) -> GroupJoined:
        if self.error is not None:
            return GroupJoined(self.rank, self.address.group_name, "failed", self.error)
        return GroupJoined(self.rank, self.address.group_name, "joined" if self.group is not None else "joining")
