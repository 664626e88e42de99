"""Rank 0's peak extra memory while publishing: streamed (tensor by tensor through two buckets), assembled (the same
pieces into one host copy in the serve's dtype, what a delta update compares) and gathered (the whole model in the
learner's dtype first, as deltas were sent before), from a 2-rank gloo FSDP2 learner, side by side in one run.

    python -m benchmarks.publish_memory [--model smollm2] [--bucket-mb 64] [--dtype bfloat16] [--repeats 3]

(launches `torchrun --nproc-per-node 2` on itself). Every rank loads the model and shards it with FSDP2
(learner/model.py:shard_policy) over gloo, as `inflight.learn` under torchrun does. Rank 0 hosts the learner's
WeightPublisher; a spawned receiver process plays the serve (benchmarks/receiver.py): it says Hello with the
checkpoint's tensors in `--dtype`, joins the weights group and unpacks + verifies every update as a serve's staging
thread does (checksums from the update itself, or its trailer when streamed), then reports each tensor's CRC32. Per
mode `--repeats` versions are published, each into a `PeakMeter` (inflight/wire/memory.py: the process's resident
high-water mark on CPU); the first publish of the run also allocates the buckets and the group's buffers, so the
figure is the median of the later ones. Written to `--out` (JSON) and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import RESULTS
from benchmarks.receiver import Receiver

MiB = 1 << 20
MODES = ("streamed", "assembled", "gathered")


def _rank_main(args) -> None:
    """Every rank: load + shard; rank 0 publishes each mode `repeats` times, the others take part in the gathers."""
    import torch.distributed as dist

    from inflight.learn.publisher import piece_bytes
    from learner.export import full_hf_state, iter_full_pieces
    from learner.model import load_policy, shard_policy
    from learner.world import start_world

    world = start_world("cpu")
    model = load_policy(args.model_dir)
    shard_policy(model, world.mesh)
    rank0 = _Rank0(args, model) if world.rank == 0 else None
    version = 0
    for mode in MODES:
        for _ in range(args.repeats):
            version += 1
            if rank0 is not None:
                rank0.publish(mode, version)
            elif mode != "gathered":
                for _ in iter_full_pieces(model, piece_bytes(args.bucket_mb * MiB)):
                    pass
            else:
                full_hf_state(model)
            dist.barrier()
    if rank0 is not None:
        rank0.report()
    world.close(clean=True)


class _Rank0:
    """The publisher, the receiver process and the measurements."""

    def __init__(self, args, model):
        from inflight.learn.publisher import open_publisher
        from inflight.wire.control import ControlServer
        from inflight.wire.weights import DTYPES
        from learner.export import hf_layout

        self.args, self.model, self.rows = args, model, []
        self.publisher = open_publisher(ControlServer(), timeout_s=300, bucket_bytes=args.bucket_mb * MiB)
        dtype = DTYPES[args.dtype]
        # Names and shapes in iter_full_pieces' order (a converted MoE layer split back), gathering nothing
        specs = {name: t.to(dtype) for name, t in hf_layout(model).items()}
        self.model_bytes = sum(t.numel() * t.element_size() for t in specs.values())
        self.largest = max(t.numel() * t.element_size() for t in specs.values())
        self.publisher.check.set_model(specs)
        spec_list = [(n, args.dtype, list(t.shape)) for n, t in specs.items()]
        self.receiver = Receiver(self.publisher.plane.control.address, spec_list)
        deadline = time.monotonic() + 120
        while not self.publisher.plane.serves and time.monotonic() < deadline:
            self.publisher.plane.pump(0.1)

    def publish(self, mode: str, version: int) -> None:
        from inflight.learn.publisher import assemble_state, piece_bytes
        from inflight.wire.memory import PeakMeter
        from learner.export import full_hf_state, iter_full_pieces

        pieces = iter_full_pieces(self.model, piece_bytes(self.args.bucket_mb * MiB))
        start = time.perf_counter()
        with PeakMeter("cpu") as peak:
            if mode == "streamed":
                report = self.publisher.publish_stream(pieces, version)
            elif mode == "assembled":
                report = self.publisher.publish(assemble_state(pieces, self.publisher.served_dtypes()), version)
            else:
                report = self.publisher.publish(full_hf_state(self.model), version)
        seconds = time.perf_counter() - start
        self.publisher.plane.wait_for_commits(version)
        self.rows.append({"mode": mode, "version": version, "peak_bytes": peak.extra_bytes, "seconds": seconds,
                          "bytes": report.bytes, "serves": report.serves, "measured": peak.measured})  # fmt: skip
        print(f"{mode} v{version}: peak extra {peak.extra_bytes / MiB:.0f} MiB, {seconds:.2f} s", flush=True)

    def report(self) -> None:
        crcs = self.receiver.stop()
        self.publisher.close()
        versions = sorted(crcs)
        same = all(crcs[v] == crcs[versions[0]] for v in versions) and len(versions) == len(MODES) * self.args.repeats
        bucket = self.args.bucket_mb * MiB
        out = {"model": self.args.model, "dtype": self.args.dtype, "bucket_bytes": bucket, "model_bytes":
               self.model_bytes, "largest_tensor_bytes": self.largest, "received_identical": same,
               "rows": self.rows}  # fmt: skip
        summary = {}
        for mode in MODES:
            later = [r for r in self.rows if r["mode"] == mode][1:] or [r for r in self.rows if r["mode"] == mode]
            summary[mode] = {"peak_bytes": statistics.median(r["peak_bytes"] for r in later),
                             "seconds": statistics.median(r["seconds"] for r in later)}  # fmt: skip
        out["summary"] = summary
        from inflight.machine import cpu_label

        out["cpu"] = cpu_label()
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(out, indent=1) + "\n")
        _print(out)


def _print(out: dict) -> None:
    bucket, s = out["bucket_bytes"], out["summary"]
    print(f"\n{out['model']} ({out['model_bytes'] / MiB:.0f} MiB in {out['dtype']}, largest tensor "
          f"{out['largest_tensor_bytes'] / MiB:.0f} MiB), 2-rank gloo FSDP2 learner, {bucket / MiB:.0f}-MiB buckets, "
          f"{out['cpu']}:")  # fmt: skip
    print("| publish | rank 0 peak extra MiB | in buckets | in model sizes | seconds |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        peak = s[mode]["peak_bytes"]
        print(f"| {mode} | {peak / MiB:.0f} | {peak / bucket:.2f} | {peak / out['model_bytes']:.2f} | "
              f"{s[mode]['seconds']:.2f} |")  # fmt: skip
    gathered = max(1, s["gathered"]["peak_bytes"])
    print(
        f"streamed / gathered peak: {s['streamed']['peak_bytes'] / gathered:.2f}; assembled / gathered: "
        f"{s['assembled']['peak_bytes'] / gathered:.2f}; every version received identical: {out['received_identical']}"
    )


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.publish_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the serve's dtype")
    parser.add_argument("--repeats", type=int, default=3, help="publishes per mode (the first is not counted)")
    parser.add_argument("--out", type=Path, default=RESULTS / "publish_memory.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)  # before launching anything: a bad flag fails here, once
    if "RANK" not in os.environ:  # launch ourselves under torchrun, two ranks on this host
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, "--nproc-per-node", "2", "-m", "benchmarks.publish_memory", *argv]
        return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    from inflight.models import prepare

    args.model_dir = prepare(args.model)
    _rank_main(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
