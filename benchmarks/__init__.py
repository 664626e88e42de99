"""The benchmark harnesses (`python -m benchmarks.<name>`, docs/benchmarks.md); each runs in its own process."""

from pathlib import Path

# Where every harness writes its results by default: this package's `results/`, whatever the working directory.
RESULTS = Path(__file__).resolve().parent / "results"
