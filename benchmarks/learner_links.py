"""How a multi-rank learner's update reaches a tensor-parallel serve (issue 41): through rank 0's single link (today:
every other rank sends its rows to rank 0, which broadcasts whole buckets) against each learner rank broadcasting its
own rows itself, side by side in one run, on CPU with gloo, where only the ratio says anything.

    python -m benchmarks.learner_links [--learners 2] [--serves 2] [--model-mb 256] [--bucket-mb 16] [--repeats 3]

Runs on the driver and spawns `--learners + --serves` processes (one gloo world over loopback). A learner rank holds
its FSDP2-style row shard (`torch.chunk` of dim 0) of every tensor of a synthetic model of `--model-mb` (float32,
4 MiB tensors); a serve rank receives every byte of the update, as a worker receiving the buckets it takes its slices
from does (inflight/wire/transfer.py:receive_kept). Per design, `--repeats` updates, interleaved:

- `rank0`: rank 0 fills each bucket with its own rows and receives the other ranks' rows straight into it (point to
  point), then broadcasts it to the serves on a background request while the next bucket fills the other buffer
  (inflight/wire/transfer.py:StreamSender's double buffering; learner/export.py:iter_full_pieces' row gathers);
- `per-rank`: every learner rank packs its own rows into its own two buffers and broadcasts them in its own group
  with the serves; a serve receives from every learner at once, one thread per learner.

Per update: the seconds from a barrier to the last serve's last bucket, and each learner rank's resident high-water
mark above its shard (`ru_maxrss`, so the bound is checked, not assumed). Written to
benchmarks/results/learner_links.json and printed with the CPU's name (inflight/machine.py:cpu_label).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import RESULTS

MiB = 1 << 20
TENSOR_ROWS, TENSOR_COLS = 1024, 1024  # 4 MiB of float32 each


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _buckets(rows: list[int], per_bucket: int) -> list[list[int]]:
    """Tensor indices per bucket, `per_bucket` tensors' worth of `rows` each."""
    return [list(range(i, min(i + per_bucket, len(rows)))) for i in range(0, len(rows), per_bucket)]


def _rank0_learner(me: int, learners: int, shard: list[torch.Tensor], group, bucket_tensors: int) -> None:
    """Rank 0 (me == 0) gathers rows into whole-tensor buckets and broadcasts them; the others send their rows."""
    shares = [len(c) for c in torch.chunk(torch.empty(TENSOR_ROWS, device="meta"), learners)]
    buffers = [torch.empty(bucket_tensors * TENSOR_ROWS * TENSOR_COLS) for _ in range(2)] if me == 0 else []
    sending = [None, None]
    for k, tensors in enumerate(_buckets(list(range(len(shard))), bucket_tensors)):
        if me != 0:
            for t in tensors:
                dist.send(shard[t], dst=0)
            continue
        if sending[k % 2] is not None:
            sending[k % 2].wait()  # this buffer's broadcast, two buckets ago
        bucket = buffers[k % 2][: len(tensors) * TENSOR_ROWS * TENSOR_COLS].view(len(tensors), TENSOR_ROWS, -1)
        for j, t in enumerate(tensors):
            bucket[j, : shares[0]].copy_(shard[t])
            offset = shares[0]
            for src in range(1, learners):
                dist.recv(bucket[j, offset : offset + shares[src]], src=src)
                offset += shares[src]
        sending[k % 2] = dist.broadcast(bucket, src=0, group=group, async_op=True)
    for request in sending:
        if request is not None:
            request.wait()


def _per_rank_learner(me: int, shard: list[torch.Tensor], group, bucket_tensors: int) -> None:
    """Every learner rank broadcasts buckets of its own rows in its own group."""
    buffers = [torch.empty(bucket_tensors * shard[0].numel()) for _ in range(2)]
    sending = [None, None]
    for k, tensors in enumerate(_buckets(list(range(len(shard))), bucket_tensors)):
        if sending[k % 2] is not None:
            sending[k % 2].wait()
        bucket = buffers[k % 2][: len(tensors) * shard[0].numel()].view(len(tensors), *shard[0].shape)
        for j, t in enumerate(tensors):
            bucket[j].copy_(shard[t])
        sending[k % 2] = dist.broadcast(bucket, src=me, group=group, async_op=True)
    for request in sending:
        if request is not None:
            request.wait()


def _serve(design: str, learners: int, groups: list, tensors: int, bucket_tensors: int) -> None:
    """Receive every bucket of the update: rank 0's group, or every learner's group at once (a thread each)."""
    shares = [len(c) for c in torch.chunk(torch.empty(TENSOR_ROWS, device="meta"), learners)]

    def receive(src: int, rows: int, group) -> None:
        buffer = torch.empty(bucket_tensors * rows * TENSOR_COLS)  # one reused buffer, as receive_kept's
        for ids in _buckets(list(range(tensors)), bucket_tensors):
            dist.broadcast(buffer[: len(ids) * rows * TENSOR_COLS], src=src, group=group)

    if design == "rank0":
        receive(0, TENSOR_ROWS, groups[0])
        return
    threads = [threading.Thread(target=receive, args=(r, shares[r], groups[r])) for r in range(learners)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _rank_main(rank: int, args, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = args.learners + args.serves
    dist.init_process_group("gloo", rank=rank, world_size=world)
    serves = list(range(args.learners, world))
    groups = [dist.new_group([r, *serves]) for r in range(args.learners)]  # every rank creates every group
    tensors = args.model_mb * MiB // (TENSOR_ROWS * TENSOR_COLS * 4)
    bucket_tensors = max(1, args.bucket_mb * MiB // (TENSOR_ROWS * TENSOR_COLS * 4))
    shard: list[torch.Tensor] = []
    if rank < args.learners:
        rows = torch.chunk(torch.empty(TENSOR_ROWS, device="meta"), args.learners)[rank].shape[0]
        shard = [torch.randn(rows, TENSOR_COLS) for _ in range(tensors)]
    baseline, seconds = _rss_mib(), {"rank0": [], "per-rank": []}
    for i in range(args.repeats):
        for design in ("rank0", "per-rank") if i % 2 == 0 else ("per-rank", "rank0"):
            dist.barrier()
            start = time.perf_counter()
            if rank >= args.learners:
                _serve(design, args.learners, groups, tensors, bucket_tensors)
            elif design == "rank0":
                _rank0_learner(rank, args.learners, shard, groups[0], bucket_tensors)
            else:
                _per_rank_learner(rank, shard, groups[rank], bucket_tensors)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the update is done when the last serve has it
            seconds[design].append(elapsed.item())
    out.put({"rank": rank, "seconds": seconds, "peak_above_shard_mib": _rss_mib() - baseline})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--serves", type=int, default=2)
    parser.add_argument("--model-mb", type=int, default=256)
    parser.add_argument("--bucket-mb", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from inflight.machine import cpu_label
    from inflight.run.launch import free_ports

    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_ports(1, "127.0.0.1")[0]
    procs = [context.Process(target=_rank_main, args=(r, args, port, out)) for r in range(args.learners + args.serves)]
    for proc in procs:
        proc.start()
    ranks = sorted((out.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join()
    median = {design: statistics.median(ranks[0]["seconds"][design]) for design in ("rank0", "per-rank")}
    result = {"cpu": cpu_label(), "args": vars(args), "ranks": ranks, "median_s": median,
              "per_rank_over_rank0": median["per-rank"] / median["rank0"]}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "learner_links.json").write_text(json.dumps(result, indent=1))
    print(f"{result['cpu']}: {args.learners} learner ranks -> {args.serves} serve ranks, {args.model_mb} MiB update")
    for design in ("rank0", "per-rank"):
        print(f"  {design:8s}: {median[design]:.3f} s per update (median of {args.repeats})")
    peaks = ", ".join(f"rank {r['rank']} {r['peak_above_shard_mib']:.0f}" for r in ranks[: args.learners])
    print(f"  per-rank / rank0: {result['per_rank_over_rank0']:.3f}; learner peak above its shard, MiB: {peaks}")


if __name__ == "__main__":
    main()
