#!/usr/bin/env bash
# Every GPU test and benchmark in one call, then one table. Run from the repository root on a CUDA machine:
#   scripts/gpu_check.sh [out_dir]          (default: $OUT if set, else ./gpu-check)
# Needs torch with CUDA, Triton, pytest, msgspec. Without CUDA the tests skip and the benchmarks refuse.
set -uo pipefail
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
$py -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"

$py -m pytest -q -p no:cacheprovider -o addopts="" --junitxml="$out/pytest.xml" \
  tests/learner/test_fused_loss.py tests/wire/test_cuda_staging.py tests/learner/test_logprobs.py \
  tests/learner/test_losses.py 2>&1 | tee "$out/pytest.log"
tests_rc=${PIPESTATUS[0]}
$py -m benchmarks.fused_loss --json "$out/fused_loss.json" 2>&1 | tee "$out/fused_loss.txt"
fused_rc=${PIPESTATUS[0]}
$py -m benchmarks.cuda_staging --json "$out/cuda_staging.json" 2>&1 | tee "$out/cuda_staging.txt"
staging_rc=${PIPESTATUS[0]}

$py - "$out" "$tests_rc" "$fused_rc" "$staging_rc" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, rcs = Path(sys.argv[1]), sys.argv[2:]
print("\n== gpu_check summary ==")
try:
    root = ET.parse(out / "pytest.xml").getroot()
    suite = root.find("testsuite") if root.find("testsuite") is not None else root
    a = suite.attrib
    print(f"tests: {a.get('tests')} run, {a.get('failures')} failed, {a.get('errors')} errors, {a.get('skipped')} skipped")
except Exception as exc:
    print("tests: no report", exc)
try:
    rows = json.loads((out / "fused_loss.json").read_text())
    print(f"{'vocab':>7} {'hidden':>6} {'path':>8} {'ms':>8} {'peak MiB':>9} {'time/naive':>10} {'mem/naive':>9}")
    for r in rows:
        print(f"{r['vocab']:>7} {r['hidden']:>6} {r['path']:>8} {r['seconds'] * 1e3:>8.1f} "
              f"{r['peak_bytes'] / 2**20:>9.0f} {r['time_ratio']:>10.3f} {r['mem_ratio']:>9.3f}")
except Exception as exc:
    print("fused_loss: no result", exc)
try:
    s = json.loads((out / "cuda_staging.json").read_text())
    print(f"staging: commit {s['commit_gbs']:.0f} GB/s = {s['commit_vs_d2d']:.2f} of d2d {s['d2d_ceiling_gbs']:.0f} GB/s; "
          f"gloo receive {s['receive_gbs']:.2f} GB/s = {s['receive_vs_h2d']:.3f} of h2d {s['h2d_ceiling_gbs']:.1f} GB/s; "
          f"decode step while staging x{s['decode_slowdown']:.3f} (median), x{s['decode_slowdown_mean']:.3f} (mean)")
except Exception as exc:
    print("cuda_staging: no result", exc)
print("exit codes (tests, fused_loss, cuda_staging):", " ".join(rcs))
sys.exit(max(int(r) for r in rcs))
PY
