"""What checking a GPU update costs, with the host round trips and without them.

    python -m benchmarks.host_round_trips [--layers 28] [--json out.json]     (needs CUDA; prints one table)

Measured side by side in one run on Qwen2.5-1.5B-shaped bf16 tensors (benchmarks/cuda_staging.py:model_state):
- sender: `plan_manifest` of the GPU state, which checksums every tensor — `sum31` on the GPU (a GPU learner's kind,
  inflight/wire/checksum.py) against CRC32 from a pageable host copy of each tensor (what a GPU learner did before);
- receiver: `unpack_buckets` over GPU buckets with verification — `sum31` on the device against CRC32 from a pinned
  host copy of each bucket (what a GPU serve did before) — and with none, the floor.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.cuda_staging import BUCKET, model_state
from inflight.wire.weights import pack_bucket, plan_manifest, unpack_buckets


def seconds(fn, reps: int = 3) -> float:
    """The fastest of `reps` timed runs after a warm-up, the device drained before and after each."""
    fn()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def receiver_buckets(state: dict[str, torch.Tensor], kind: str):
    manifest = plan_manifest(state, 1, BUCKET, checksum_kind=kind)
    buckets = [
        pack_bucket(manifest, i, state, torch.empty(size, dtype=torch.uint8, device="cuda"))
        for i, size in enumerate(manifest.bucket_sizes)
    ]
    return manifest, buckets


def measure(layers: int) -> dict:
    state = model_state(layers, "cuda")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    row = {"bytes": nbytes, "gpu": torch.cuda.get_device_name(), "layers": layers}
    for kind in ("crc32", "sum31"):
        row[f"send_{kind}_s"] = seconds(lambda kind=kind: plan_manifest(state, 1, BUCKET, checksum_kind=kind))
        manifest, buckets = receiver_buckets(state, kind)
        row[f"receive_{kind}_s"] = seconds(lambda m=manifest, b=buckets: unpack_buckets(m, b, verify=True))
    row["receive_unverified_s"] = seconds(lambda: unpack_buckets(manifest, buckets, verify=False))
    row["send_speedup"] = row["send_crc32_s"] / row["send_sum31_s"]
    row["receive_speedup"] = row["receive_crc32_s"] / row["receive_sum31_s"]
    return row


def report(row: dict) -> None:
    gb = row["bytes"] / 1e9
    print(f"{row['gpu']}: {gb:.2f} GB of bf16 tensors ({row['layers']} layers)")
    print(f"{'path':<44} {'seconds':>8} {'GB/s':>8}")
    for key, label in (
        ("send_crc32_s", "sender: CRC32 via pageable host copies"),
        ("send_sum31_s", "sender: sum31 on the GPU"),
        ("receive_crc32_s", "receiver: CRC32 via pinned bucket copies"),
        ("receive_sum31_s", "receiver: sum31 on the GPU"),
        ("receive_unverified_s", "receiver: no check (floor)"),
    ):
        print(f"{label:<44} {row[key]:>8.3f} {gb / row[key]:>8.1f}")
    print(f"speed-ups: sender x{row['send_speedup']:.1f}, receiver x{row['receive_speedup']:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_round_trips measures GPU paths: no CUDA device here")
    row = measure(args.layers)
    report(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
