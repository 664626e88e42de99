"""What authenticating weight updates costs: keyed BLAKE2b tags next to CRC32 checksums, per GB, side by side in one
run on the same bytes (inflight/wire/weights.py: without a secret every tensor is CRC32-checked; with `--secret-file`
every tensor carries a keyed BLAKE2b tag, made by the learner and checked by each serve worker off the engine thread).

    python -m benchmarks.tag_cost [--mb 256] [--tensor-mb 16] [--repeats 3]

The buffer is cut into tensors of `--tensor-mb` (a checkpoint's large matrices); each hash runs over every tensor, the
best of `--repeats` passes counts. Prints seconds per GB for both and their ratio, and writes them with the CPU label
to `benchmarks/results/tag_cost.json`.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib

import torch

from benchmarks import RESULTS
from inflight.wire.secure import weights_key
from inflight.wire.weights import bytes_tag, update_key

OUT = RESULTS / "tag_cost.json"


def seconds_per_gb(fn, tensors: list, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for t in tensors:
            fn(t)
        best = min(best, time.perf_counter() - start)
    return best / (sum(t.nbytes for t in tensors) / 1e9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tag_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="bytes hashed per pass, in MiB (default 256)")
    parser.add_argument("--tensor-mb", type=int, default=16, help="size of each tensor, in MiB (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="passes; the best counts (default 3)")
    args = parser.parse_args(argv)
    from inflight.machine import cpu_info

    data = torch.randint(0, 256, (args.mb << 20,), dtype=torch.uint8).numpy()
    step = args.tensor_mb << 20
    tensors = [data[i : i + step] for i in range(0, len(data), step)]
    key = update_key(weights_key(b"a benchmark secret of 32 bytes.."), 1)
    crc = seconds_per_gb(zlib.crc32, tensors, args.repeats)
    tag = seconds_per_gb(lambda t: bytes_tag(t, key), tensors, args.repeats)
    record = {"cpu": cpu_info()[0], "bytes": int(data.nbytes), "tensor_bytes": step, "crc32_s_per_gb": crc,
              "blake2b_tag_s_per_gb": tag, "tag_over_crc32": tag / crc}  # fmt: skip
    print(f"{record['cpu']}: CRC32 {crc:.3f} s/GB ({1 / crc:.2f} GB/s), keyed BLAKE2b {tag:.3f} s/GB "
          f"({1 / tag:.2f} GB/s): the tag costs {tag / crc:.1f}x CRC32")  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
