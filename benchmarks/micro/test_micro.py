"""pytest-benchmark micro benchmarks: bucket pack/unpack, weights-group transfer vs memcpy, chunked vs naive logprobs.

    make bench-micro        # = pytest benchmarks/micro --benchmark-enable --benchmark-only ...
    pytest benchmarks/micro --benchmark-disable    # each body once, as a test (what `make test` does)

Sizes are SmolLM2-like: 64 MiB of weights in 16 MiB buckets for the wire path; 2048 tokens × 576 hidden × 49152 vocab
for the LM-head logprobs. Each group (`--benchmark-group-by group`) holds a baseline next to the path it bounds.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from inflight.wire.group import GroupAddress, WeightsGroup
from inflight.wire.weights import pack_bucket, plan_manifest, unpack_buckets
from learner.model import naive_token_logprobs, token_logprobs

MIB = 1 << 20
ROUNDS = 5


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # 16 tensors of 2 MiB fp32 each + 8 of 4 MiB bf16 = 64 MiB, shaped like decoder projections.
    out = {f"layers.{i}.mlp.weight": torch.randn(1024, 512, generator=g) for i in range(16)}
    out |= {f"layers.{i}.attn.weight": torch.randn(2048, 1024, generator=g).bfloat16() for i in range(8)}
    return out


@pytest.mark.benchmark(group="bucket 64 MiB")
def test_memcpy_baseline_64mib(benchmark, state):
    flat = [t.reshape(-1).view(torch.uint8) for t in state.values()]
    out = torch.empty(sum(t.numel() for t in flat), dtype=torch.uint8)

    def copy_all():
        offset = 0
        for t in flat:
            out[offset : offset + t.numel()].copy_(t)
            offset += t.numel()

    benchmark(copy_all)
    assert torch.equal(out[-flat[-1].numel() :], flat[-1]) and torch.equal(out[: flat[0].numel()], flat[0])


@pytest.mark.benchmark(group="bucket 64 MiB")
def test_pack_buckets_64mib(benchmark, state):
    manifest = plan_manifest(state, 1, 16 * MIB, checksums=False)
    buf = torch.empty(max(manifest.bucket_sizes), dtype=torch.uint8)

    def pack_all():
        for i in range(len(manifest.bucket_sizes)):
            pack_bucket(manifest, i, state, buf)

    benchmark(pack_all)
    assert len(manifest.bucket_sizes) == 4


@pytest.mark.benchmark(group="bucket 64 MiB")
@pytest.mark.parametrize("verify", [False, True], ids=["views", "views+crc32"])
def test_unpack_buckets_64mib(benchmark, state, verify):
    manifest = plan_manifest(state, 1, 16 * MIB, checksums=True)
    buckets = [torch.empty(n, dtype=torch.uint8) for n in manifest.bucket_sizes]
    for i, b in enumerate(buckets):
        pack_bucket(manifest, i, state, b)
    out = benchmark(unpack_buckets, manifest, buckets, verify)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def _receiver(port: int, nbytes: int, rounds: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    group = WeightsGroup(GroupAddress("127.0.0.1", port, 2, "micro", "gloo", 60.0), rank=1)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(rounds):
        group.broadcast(buf)
    group.close()


@pytest.mark.benchmark(group="transfer 64 MiB")
def test_gloo_broadcast_64mib_to_another_process(benchmark):
    from inflight.wire.group import open_store

    address = GroupAddress("127.0.0.1", 0, 2, "micro", "gloo", 60.0)
    store = open_store(address, is_host=True)
    address = GroupAddress("127.0.0.1", store.port, 2, "micro", "gloo", 60.0)
    rounds = 1 if benchmark.disabled else ROUNDS
    peer = mp.get_context("spawn").Process(target=_receiver, args=(store.port, 64 * MIB, rounds + 1))
    peer.start()
    group = WeightsGroup(address, 0, store=store)
    payload = torch.full((64 * MIB,), 7, dtype=torch.uint8)
    group.broadcast(payload)  # warm-up: the connection is set up on the first collective
    benchmark.pedantic(group.broadcast, args=(payload,), rounds=rounds, iterations=1)
    peer.join(60)
    group.close()
    assert peer.exitcode == 0


@pytest.mark.benchmark(group="transfer 64 MiB")
def test_memcpy_64mib_baseline(benchmark):
    src = torch.full((64 * MIB,), 7, dtype=torch.uint8)
    dst = torch.empty_like(src)
    benchmark(dst.copy_, src)
    assert torch.equal(src, dst)


@pytest.fixture(scope="module")
def lm_head_inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2048, 576, generator=g, requires_grad=True)
    weight = (0.02 * torch.randn(49152, 576, generator=g)).requires_grad_()
    targets = torch.randint(0, 49152, (2048,), generator=g)
    return hidden, weight, targets


@pytest.mark.benchmark(group="logprobs fwd+bwd 2048 tok × 49152 vocab")
@pytest.mark.parametrize("impl", ["naive", "chunked"])
def test_token_logprobs_forward_backward(benchmark, lm_head_inputs, impl):
    hidden, weight, targets = lm_head_inputs

    def step():
        hidden.grad = weight.grad = None
        if impl == "naive":
            out = naive_token_logprobs(hidden, weight, targets)
        else:
            out = token_logprobs(hidden, weight, targets, chunk_tokens=512)
        out.sum().backward()
        return out

    out = benchmark.pedantic(step, rounds=1 if benchmark.disabled else 3, iterations=1)
    assert out.shape == (2048,) and torch.isfinite(out).all() and hidden.grad is not None


@pytest.mark.engine_bench
@pytest.mark.benchmark(group="commit vs model size")
@pytest.mark.parametrize("model", ["tiny-llama", "smollm2"])
def test_commit_time_vs_model_size(benchmark, model):
    """Receive + commit of a full update on a real engine (bf16), idle engine: the stall a never-stop update costs
    grows with the model (vLLM's layerwise reload + the CPU repack of every linear layer). Not in `make test`."""
    import asyncio
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from support import Sender, load_state, start_engine, stop_engine

    from inflight.models import prepare

    path = prepare(model)
    loop = asyncio.new_event_loop()
    engine = start_engine(loop, path, dtype="bfloat16")
    try:
        sender = Sender()
        loop.run_until_complete(sender.connect(engine))
        state = {k: v.bfloat16() for k, v in load_state(path).items()}
        version = iter(range(1, 1000))
        reports = []

        def update():
            reports.append(loop.run_until_complete(sender.push(engine, state, next(version), bucket_bytes=16 << 20)))

        benchmark.pedantic(update, rounds=1 if benchmark.disabled else 4, iterations=1, warmup_rounds=0)
        benchmark.extra_info["commit_ms"] = [round(1e3 * r.commit_s, 1) for r in reports]
        assert all(r.version >= 1 for r in reports)
    finally:
        stop_engine(loop, engine)
