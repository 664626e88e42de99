"""What crosses between the worker and the engine: what the worker extension's `inflight_*` methods and the EngineCore
utility `inflight_commit` return, and the `StagedSignal` a worker's staging thread pushes when its update is staged
(vllm_patches/staging.py:StagedNotifier), as typed records shared by the worker (writer) and the engine (reader).

The results cross processes inside vLLM: worker → EngineCore by pickle with the multiprocess executor (Structs pickle
as themselves) and EngineCore → front-end by vLLM's msgpack, which encodes a Struct as a map and, unless
VLLM_ALLOW_INSECURE_SERIALIZATION is set, decodes it as a plain dict. The reader therefore passes every result
through `rpc_result`, which takes either form and raises naming the method and the field when they disagree.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec

T = TypeVar("T")


class GroupJoined(msgspec.Struct, forbid_unknown_fields=True):
    """`inflight_init_weights_group` and `inflight_weights_group_state`: this worker's membership of the weights group
    `group_name` as `rank` — "joining" while it forms (vllm_patches/joining.py), "joined", or "failed" with `error`."""

    rank: int
    group_name: str
    state: Literal["joining", "joined", "failed"] = "joined"
    error: str | None = None


class StageStatus(msgspec.Struct, forbid_unknown_fields=True):
    """`inflight_begin_update`, `inflight_update_status` and every `StagedSignal`: one worker's staged update.

    `receive_s`, `verify_s` and `prepare_s` (loading into a processed copy, `--update-memory double`) are durations in
    seconds, 0 until done; `started_at` and `staged_at` are wall clock
    (`time.time()`, comparable with token timestamps), `staged_at` 0 until staged. `error` is set only when failed.
    """

    version: int
    state: Literal["receiving", "staged", "failed", "committed"]
    error: str | None
    bytes_received: int
    bytes_total: int
    receive_s: float
    verify_s: float
    started_at: float
    staged_at: float
    prepare_s: float = 0.0
    bytes_kept: int = 0  # staged on this worker: its tensor-parallel slices, or every byte
    full_tensors: list[str] = msgspec.field(default_factory=list)  # kept whole: their layout is not known
    refused: bool = False  # failed because the update does not fit the worker's staging arena (nothing received)


class StagedSignal(msgspec.Struct, forbid_unknown_fields=True):
    """A worker's staging thread to the engine, once, when the update begun under `ticket` is staged or failed.

    Sent on the staged-signal channel (vllm_patches/update_frontend.py:StagedSignals), not through vLLM: the engine
    awaits it while EngineCore keeps stepping. `ticket` is the engine's number for that `update()` (a late signal of an
    update the engine gave up on carries an older one and is dropped); `worker` is the sender's rank among the engine's
    workers.
    """

    ticket: int
    worker: int
    status: StageStatus


class CommitApplied(msgspec.Struct, forbid_unknown_fields=True):
    """`inflight_commit_staged`: one worker put the staged update into its live model in `apply_s` seconds, by
    swapping in `swapped_layers` prepared layers (`--update-memory double`) or, when 0, copying in place (`low`)."""

    version: int
    apply_s: float
    swapped_layers: int = 0


class RankCommit(msgspec.Struct, forbid_unknown_fields=True):
    """`inflight_commit_staged`, the first phase of a commit on one tensor-parallel `rank`: `applied` when it put the
    update into its live weights (kept undoable until settled), else `error` says why and `restored` whether its
    weights are still the previous version (False: its own rollback failed too). Never raised as an exception: vLLM's
    multiprocess executor raises on the first failed rank and leaves the other ranks' answers unread in their queues."""

    rank: int
    applied: CommitApplied | None = None
    error: str = ""
    restored: bool = True


class RankSettled(msgspec.Struct, forbid_unknown_fields=True):
    """`inflight_settle_commit`, the second phase on one `rank`: `done` is "kept", "rolled back" or "nothing" (this rank
    had not applied it), or "failed" with `error` (a rollback that failed: the rank serves neither version)."""

    rank: int
    done: str
    error: str = ""


class HeldWeights(msgspec.Struct, forbid_unknown_fields=True):
    """`inflight_held_weights`: the whole tensors this worker keeps of its live version (the in-place path's rollback
    source and the base of a delta update): `version` (-1 when none is kept) and the CRC32 of every tensor's bytes."""

    version: int
    crc32: dict[str, int]


class CommitResult(msgspec.Struct, forbid_unknown_fields=True):
    """The EngineCore utility `inflight_commit`: every worker committed `version` and EngineCore serves it now.
    `stall_s` is the engine-step gap the commit took (seconds, measured in EngineCore)."""

    version: int
    stall_s: float
    workers: list[CommitApplied]


def rpc_result(value: object, kind: type[T], method: str) -> T:
    """`value` (a Struct, or the dict msgpack made of it) as `kind`; raises TypeError naming `method` and the field."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise TypeError(
            f"{method} returned {value!r}, not {kind}: {exc}; the worker and the engine disagree on this record: "
            "rename the field in vllm_patches/rpc.py and on both sides together"
        ) from exc
