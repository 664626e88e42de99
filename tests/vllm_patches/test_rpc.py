"""The worker RPC records (vllm_patches/rpc.py) across the paths vLLM carries them on, without starting an engine:
pickle (worker → EngineCore, multiprocess executor) and vLLM's own msgpack (EngineCore → front-end), which hands the
reader plain dicts. The engine tests (test_inflight.py, test_bad_updates.py) run the same calls for real."""

from __future__ import annotations

import pickle

import pytest
import torch

from inflight.wire.weights import plan_manifest
from vllm_patches.rpc import CommitApplied, CommitResult, GroupJoined, StageStatus, rpc_result
from vllm_patches.staging import StagedUpdate


def a_status() -> StageStatus:
    """What the worker returns for an update it has just begun (the real StagedUpdate, never started)."""
    manifest = plan_manifest({"w": torch.ones(4, 3)}, version=7, bucket_bytes=1 << 10)
    return StagedUpdate(manifest, group=None).status()


def through_engine_core_output(result):
    """`result` as the front-end receives a utility call's answer: encoded and decoded by vLLM's msgpack."""
    from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

    message = EngineCoreOutputs(utility_output=UtilityOutput(call_id=1, result=UtilityResult(result)))
    return MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(message)).utility_output.result.result


def test_a_stage_status_survives_pickle_as_itself():
    status = a_status()
    assert status.state == "receiving" and status.version == 7 and status.bytes_total == 48
    assert pickle.loads(pickle.dumps(status)) == status


def test_collective_rpc_results_arrive_as_dicts_and_the_reader_restores_the_records(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    statuses = [a_status(), a_status()]
    arrived = through_engine_core_output(statuses)
    assert isinstance(arrived[0], dict)  # vLLM's msgpack keeps no type: the engine must convert
    assert rpc_result(arrived, list[StageStatus], "inflight_update_status") == statuses
    joined = [GroupJoined(rank=1, group_name="w3")]
    assert rpc_result(through_engine_core_output(joined), list[GroupJoined], "inflight_init_weights_group") == joined


def test_the_commit_utility_result_keeps_each_workers_record():
    result = CommitResult(version=3, stall_s=0.25, workers=[CommitApplied(version=3, apply_s=0.2)])
    arrived = through_engine_core_output(result)
    assert rpc_result(arrived, CommitResult, "inflight_commit") == result
    assert rpc_result(result, CommitResult, "inflight_commit") is result  # in-process: passed through as it is


def test_a_renamed_field_in_a_worker_result_names_the_method_and_the_field():
    arrived = through_engine_core_output([a_status()])
    arrived[0]["bytes_done"] = arrived[0].pop("bytes_received")  # the worker renamed a field the engine reads
    with pytest.raises(TypeError, match=r"inflight_update_status returned .*unknown field `bytes_done`"):
        rpc_result(arrived, list[StageStatus], "inflight_update_status")
    with pytest.raises(TypeError, match=r"inflight_commit returned .*missing required field `workers`"):
        rpc_result({"version": 1, "stall_s": 0.1}, CommitResult, "inflight_commit")
