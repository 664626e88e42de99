"""benchmarks/publish_memory.py end to end (torchrun, 2 gloo FSDP2 ranks on SmolLM2, a receiver process): a streamed
publish keeps rank 0's peak extra memory within 3 buckets; one assembled in host memory in the serve's bf16 (a delta's
state) takes the model once and the buckets, less than the float32 model gathered whole; every update arrives
identical in all three ways."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine  # slow (two SmolLM2 ranks); no engine, but the same budget class


def test_a_streamed_publish_from_two_fsdp_ranks_peaks_within_three_buckets_and_equals_the_gathered_one(tmp_path):
    out = tmp_path / "publish_memory.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.publish_memory", "--repeats", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    if not all(row["measured"] for row in result["rows"]):
        pytest.skip("this kernel does not let a process reset its resident high-water mark (/proc/self/clear_refs)")
    print("\n" + "\n".join(line for line in run.stdout.splitlines() if line.startswith(("|", "smollm2", "streamed"))))
    streamed, gathered = result["summary"]["streamed"]["peak_bytes"], result["summary"]["gathered"]["peak_bytes"]
    assert result["received_identical"], "the streamed and gathered updates differ"
    assert streamed <= 3 * result["bucket_bytes"], f"streamed peak {streamed / 2**20:.0f} MiB is over 3 buckets"
    assert streamed < gathered / 2, "streaming saved less than half of the gathered path's peak"
    assembled = result["summary"]["assembled"]["peak_bytes"]
    # the model once in bf16 and the buckets (seen: 330 MiB of 257 + 2 x 64), where gathered whole it was 730 MiB
    bound = result["model_bytes"] + 3 * result["bucket_bytes"]
    assert assembled <= bound < gathered, f"assembled peak {assembled / 2**20:.0f} MiB, bound {bound / 2**20:.0f}"
