"""The numerically sensitive tests once more, limited to the kernels a CPU without AMX or avx512_bf16 takes (oneDNN
and MKL capped at AVX2, ATen's own kernels at AVX2), on a CPU that has AVX-512: so a run on one kind of machine also
proves that the tolerances (tests/tolerances.py, derived from the arithmetic) hold on the other kind. A CPU without
AVX-512 already takes exactly those kernels in the suite's own run of these tests: there this one is skipped.

The variables are read when a process starts, so the tests run in a child pytest. Inside the suite rather than before
it (as `make test` used to run them), its 70 s overlap the other xdist worker's modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
NUMERIC_TESTS = [
    "tests/learner/test_step.py",
    "tests/learner/test_logprobs.py",
    "tests/learner/test_fused_loss.py",
    "tests/learner/test_model.py",
    "tests/learner/test_losses.py",
    "tests/inflight/test_advantages.py",
    "tests/inflight/test_logprob_parity.py",  # a bf16 serve's kernels too: it starts one
]


def has_avx512() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


@pytest.mark.engine
@pytest.mark.skipif(not has_avx512(), reason="no AVX-512: the suite's own run of these tests is on the AVX2 kernels")
def test_the_numerically_sensitive_tests_pass_on_the_kernels_of_a_cpu_without_avx512(tmp_path):
    # not this run's options (a junit file, xdist's worker identity) nor its ISA: a pytest of its own
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "ONEDNN_", "MKL_", "ATEN_"))}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "avx2")]
    done = subprocess.run([*command, *NUMERIC_TESTS], cwd=ROOT, env={**env, **AVX2_ONLY}, capture_output=True,
                          text=True, timeout=1200, check=False)  # fmt: skip
    assert done.returncode == 0, f"on AVX2 kernels ({AVX2_ONLY}):\n{done.stdout[-8000:]}\n{done.stderr[-2000:]}"
    assert " passed" in done.stdout.splitlines()[-1], done.stdout[-2000:]
